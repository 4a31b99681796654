"""Fine-tune data: a fine-tune's images, latents and class images, as its trainer reads them."""
