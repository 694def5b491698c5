"""Constrained decoding: grammars compiled against the model's tokenizer (compile.py) and the
host-side state of each constrained row (row.py). The decode loop's side is the gate in
decoding/block_buffer.py; docs/architecture.md ("Structured output") explains the rule."""
