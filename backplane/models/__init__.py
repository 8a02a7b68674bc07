"""HF-config-compatible model implementations whose mixers call the op families."""
