"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar, structural tag)
compiled into a grammar whose per-sequence matcher masks the next token (xgrammar)."""
