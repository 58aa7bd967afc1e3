"""Chat templates the tests render with, beside the embedded model's own."""

# A Qwen3-style template: reasoning is rendered only for assistant turns after the last user
# message (history reasoning is stripped), tool calls as <tool_call> blocks, and the generation
# prompt pre-fills <think> unless enable_thinking is false.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_query and m.reasoning_content -%}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- m.content -}}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + (tc.function.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

# Templates written to each family's documented prompt format (model cards; tool-call rendering as
# the families' own templates do it), for the synthetic tokenizers of helpers.synthetic_tokenizer.

# Llama 3.1: header-delimited turns, tool results in the ipython role, calls as JSON with "parameters".
LLAMA3_LIKE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- set role = 'ipython' if m.role == 'tool' else m.role -%}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' -}}"
    "{%- if m.tool_calls -%}"
    "{%- for tc in m.tool_calls -%}"
    "{{- '{\"name\": \"' + tc.function.name + '\", \"parameters\": ' + (tc.function.arguments | tojson) + '}' -}}"
    "{%- endfor -%}"
    "{%- else -%}{{- m.content -}}{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

# Mistral v3 (7B-Instruct-v0.3): [INST] turns, [TOOL_CALLS] JSON list with 9-character ids, tool
# results echoing the call id; like the family's template, it refuses any other id.
MISTRAL_LIKE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or m.role == 'system' -%}{{- '[INST] ' + m.content + '[/INST]' -}}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{{- '[TOOL_CALLS] [' -}}"
    "{%- for tc in m.tool_calls -%}"
    "{%- if not (tc.id is string and tc.id | length == 9) -%}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') -}}{%- endif -%}"
    '{{- \'{"name": "\' + tc.function.name + \'", "arguments": \' + (tc.function.arguments | tojson) + \', "id": "\' + tc.id + \'"}\' -}}'
    "{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- ']' + eos_token -}}"
    "{%- elif m.role == 'assistant' -%}{{- ' ' + m.content + eos_token -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if not (m.tool_call_id is string and m.tool_call_id | length == 9) -%}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') -}}{%- endif -%}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + (m.content | tojson) + ', \"call_id\": \"' + m.tool_call_id + '\"}[/TOOL_RESULTS]' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# DeepSeek V3: <｜User｜>/<｜Assistant｜> turns, calls as function<｜tool▁sep｜>NAME + a ```json block.
DEEPSEEK_LIKE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{- m.content -}}"
    "{%- elif m.role == 'user' -%}{{- '<｜User｜>' + m.content -}}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{{- '<｜Assistant｜>' + m.content + '<｜tool▁calls▁begin｜>' -}}"
    "{%- for tc in m.tool_calls -%}"
    "{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + tc.function.name + '\\n```json\\n' + (tc.function.arguments | tojson) + '\\n```<｜tool▁call▁end｜>' -}}"
    "{%- endfor -%}"
    "{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' -}}"
    "{%- elif m.role == 'assistant' -%}{{- '<｜Assistant｜>' + m.content + '<｜end▁of▁sentence｜>' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"
)
