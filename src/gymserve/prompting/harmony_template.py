"""A chat template for gpt-oss: OpenAI chat messages rendered in the harmony format.

Source: OpenAI's harmony format guide and the ``openai-harmony`` renderer (its Rust
``render_conversation_for_completion`` is the reference behaviour). Use it as any chat template
(``chat_template: harmony`` in the local backend's config selects it; the gpt-oss checkpoints'
own ``chat_template.jinja`` works too). What it renders:

- a ``system`` message: the model identity, ``Knowledge cutoff:``, ``Current date:`` (only when
  the ``current_date`` template kwarg is given: a date that changes every day would make the same
  rollout render differently), ``Reasoning: {reasoning_effort}`` (kwarg, default ``medium``), the
  valid channels and, when tools are given, that calls go to the ``commentary`` channel;
- a ``developer`` message: ``# Instructions`` (the leading system/developer messages, joined by a
  blank line) and ``# Tools`` with each function in the ``functions`` namespace as a TypeScript-like
  type (descriptions as ``//`` comments, optional fields ``?``, enums as unions, ``// default:``);
- user turns; assistant turns as harmony messages: reasoning (``reasoning_content``) on the
  ``analysis`` channel, a final answer on ``final``, content beside tool calls as a
  ``commentary`` preamble, each tool call as ``<|start|>assistant to=functions.NAME<|channel|>
  commentary <|constrain|>json<|message|>ARGS<|call|>`` (arguments as compact JSON, as the model
  writes them); tool outputs as ``<|start|>functions.NAME to=assistant<|channel|>commentary
  <|message|>OUTPUT<|end|>`` (NAME from the call the ``tool_call_id`` answers);
- what to keep of earlier reasoning: the analysis of a turn that ended in a final answer is dropped
  from later prompts; the analysis of tool-call turns after the last final answer is kept (the
  model reasons across tool calls); the last message's analysis is kept when rendering without a
  generation prompt (a training target);
- ``<|return|>`` never appears in history: a final answer ends with ``<|end|>``;
- the generation prompt ``<|start|>assistant``.
"""

from __future__ import annotations

HARMONY_TEMPLATE = r"""
{#- Every literal is an expression: apply_chat_template renders with trim_blocks and lstrip_blocks. -#}
{%- macro ts_type(s) -%}
{%- if s is not mapping -%}{{- 'any' -}}
{%- elif s.enum is defined and s.enum -%}
{%- for v in s.enum -%}{{- v | tojson -}}{%- if not loop.last -%}{{- ' | ' -}}{%- endif -%}{%- endfor -%}
{%- elif s.type is defined and s.type is not string and s.type is iterable -%}
{%- for t in s.type -%}{{- ts_type({'type': t}) -}}{%- if not loop.last -%}{{- ' | ' -}}{%- endif -%}{%- endfor -%}
{%- elif s.type == 'string' -%}{{- 'string' -}}
{%- elif s.type == 'number' or s.type == 'integer' -%}{{- 'number' -}}
{%- elif s.type == 'boolean' -%}{{- 'boolean' -}}
{%- elif s.type == 'null' -%}{{- 'null' -}}
{%- elif s.type == 'array' -%}{{- ts_type(s['items'] if s['items'] is defined else {}) + '[]' -}}
{%- elif s.type == 'object' and s.properties is defined and s.properties -%}{{- '{\n' + ts_fields(s) + '}' -}}
{%- else -%}{{- 'any' -}}
{%- endif -%}
{%- endmacro -%}
{%- macro ts_fields(s) -%}
{%- for name, p in s.properties.items() -%}
{%- if p is mapping and p.description is defined and p.description -%}{{- '// ' + p.description + '\n' -}}{%- endif -%}
{{- name -}}{%- if name not in (s.required or []) -%}{{- '?' -}}{%- endif -%}{{- ': ' + ts_type(p) + ',' -}}
{%- if p is mapping and p.default is defined -%}
{{- ' // default: ' + (p.default if p.default is string else p.default | tojson) -}}
{%- endif -%}
{{- '\n' -}}
{%- endfor -%}
{%- endmacro -%}
{%- set ns = namespace(lead=0, last_final=-1, instructions=[], last_call='') -%}
{%- for m in messages -%}
{%- if (m.role == 'system' or m.role == 'developer') and ns.lead == loop.index0 -%}
{%- set ns.lead = loop.index0 + 1 -%}
{%- if m.content -%}{%- set ns.instructions = ns.instructions + [m.content] -%}{%- endif -%}
{%- endif -%}
{%- if m.role == 'assistant' and not m.tool_calls -%}{%- set ns.last_final = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{{- '<|start|>system<|message|>' + (model_identity | default('You are ChatGPT, a large language model trained by OpenAI.', true)) + '\n' -}}
{{- 'Knowledge cutoff: ' + (knowledge_cutoff | default('2024-06', true)) + '\n' -}}
{%- if current_date is defined and current_date -%}{{- 'Current date: ' + current_date + '\n' -}}{%- endif -%}
{{- '\nReasoning: ' + (reasoning_effort | default('medium', true)) + '\n\n' -}}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- '<|end|>' -}}
{%- if ns.instructions or tools -%}
{{- '<|start|>developer<|message|>' -}}
{%- if ns.instructions -%}
{{- '# Instructions\n\n' + ns.instructions | join('\n\n') -}}
{%- if tools -%}{{- '\n\n' -}}{%- endif -%}
{%- endif -%}
{%- if tools -%}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
{%- for t in tools -%}
{%- set f = t.function if t.function is defined else t -%}
{%- if f.description -%}{{- '// ' + f.description + '\n' -}}{%- endif -%}
{%- set params = f.parameters if f.parameters is defined and f.parameters is mapping else {} -%}
{%- if params.properties is defined and params.properties -%}
{{- 'type ' + f.name + ' = (_: {\n' + ts_fields(params) + '}) => any;\n\n' -}}
{%- else -%}
{{- 'type ' + f.name + ' = () => any;\n\n' -}}
{%- endif -%}
{%- endfor -%}
{{- '} // namespace functions' -}}
{%- endif -%}
{{- '<|end|>' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' or m.role == 'developer' -%}
{%- if loop.index0 >= ns.lead -%}{{- '<|start|>developer<|message|># Instructions\n\n' + m.content + '<|end|>' -}}{%- endif -%}
{%- elif m.role == 'user' -%}
{{- '<|start|>user<|message|>' + m.content + '<|end|>' -}}
{%- elif m.role == 'assistant' -%}
{%- if m.tool_calls -%}
{%- if m.reasoning_content and loop.index0 > ns.last_final -%}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|>' -}}
{%- endif -%}
{%- if m.content -%}{{- '<|start|>assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' -}}{%- endif -%}
{%- for tc in m.tool_calls -%}
{%- set args = tc.function.arguments -%}
{%- set ns.last_call = tc.function.name -%}
{{- '<|start|>assistant to=functions.' + tc.function.name + '<|channel|>commentary <|constrain|>json<|message|>' -}}
{{- (args if args is string else args | tojson(separators=(',', ':'))) + '<|call|>' -}}
{%- endfor -%}
{%- else -%}
{%- if m.reasoning_content and loop.last and not add_generation_prompt -%}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|>' -}}
{%- endif -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}
{%- endif -%}
{%- elif m.role == 'tool' -%}
{%- set found = namespace(name=m.name if m.name is defined and m.name else ns.last_call) -%}
{%- for prev in messages[:loop.index0] -%}{%- for tc in prev.tool_calls or [] -%}
{%- if tc.id is defined and tc.id == m.tool_call_id -%}{%- set found.name = tc.function.name -%}{%- endif -%}
{%- endfor -%}{%- endfor -%}
{{- '<|start|>functions.' + found.name + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""
"""The harmony chat template (Jinja, rendered by ``tokenizer.apply_chat_template``)."""

BUILTIN_TEMPLATES = {"harmony": HARMONY_TEMPLATE}
"""Chat templates selectable by name (``chat_template: harmony``)."""
