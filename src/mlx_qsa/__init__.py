"""mlx-qsa: QSA (Qwen sparse attention) for MLX."""
