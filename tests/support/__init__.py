"""What the tests share: tiny and context-sensitive models, model folders, the constraint simulator, the
Triton interpreter's switch, the README's code blocks."""
