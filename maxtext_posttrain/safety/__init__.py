"""Safety evaluation (prompt suites, refusal judges) and privacy tools (PII detection and redaction, canaries)."""
