"""Test helpers (fakes, spec validation, templates, tiny models), imported as ``helpers.x``."""
