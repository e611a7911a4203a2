"""Images in prompts: preprocessing, placeholder expansion, M-RoPE positions and the vision encoder cache."""
