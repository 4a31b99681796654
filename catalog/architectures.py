"""SD1.x's frozen networks as architecture configs (values of `Model.vae_config` and
`Model.text_config`), for building them at full size with random weights where their weights
cannot be read: benchmarks and GPU tests, whose speed and tolerances depend on the shapes, not
on the values. `sample_size` (the VAE's tile size, used only by tiled decoding) is the caller's.
"""

from __future__ import annotations

SD_VAE_CONFIG = {  # stabilityai/sd-vae-ft-mse
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
}
CLIP_L_TEXT_CONFIG = {  # openai/clip-vit-large-patch14's text tower
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
    "bos_token_id": 49406,
    "eos_token_id": 49407,
    "pad_token_id": 49407,
}
