"""Chat messages → the prompt token IDs the policy model sees: the chat template and the prefix splice.

This package sits above the engines (which only turn token IDs into token IDs) and below the local
backend, which calls ``build_prompt`` once per model call:

- ``template``: ``ChatTemplate``, the chat template rendered and tokenized the way ``vllm serve`` does;
- ``splice``: the on-policy prefix splice (a turn's prompt starts with the previous prompt + generation);
- ``prefix``: ``required_prefix_token_ids`` (NeMo RL's), the exact IDs a prompt must start with;
- ``build``: ``build_prompt``, the three combined, tokenizing only what is new.
"""

from gymserve.prompting.build import PromptResult, RenderOptions, build_prompt
from gymserve.prompting.template import TAIL_CHARS, ChatTemplate

__all__ = ["TAIL_CHARS", "ChatTemplate", "PromptResult", "RenderOptions", "build_prompt"]
