"""models/: the one decoder used for training, prefill and decode (not built yet: see issue 4)."""
