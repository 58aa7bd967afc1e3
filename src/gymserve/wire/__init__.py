"""The wire vocabulary every layer shares, one module per word: ``reasoning`` (the reasoning field
names and the rule for reading them), ``ids`` (minting OpenAI-style ids), ``think`` (the
``<think>`` tags and how text is split on them). Nothing here imports gymserve beyond ``text``.
"""
