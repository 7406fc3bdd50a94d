"""Decoding: plain KV-cached generation and speculative decoding with the MTP modules as the draft model."""
