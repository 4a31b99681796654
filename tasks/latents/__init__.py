"""Latents: image decoding, tokenize, encode (VAE), the keys of encoded shards, HF export."""
