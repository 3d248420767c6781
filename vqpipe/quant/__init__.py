"""Quantizing a whole mlx-lm model: ``quantize_model`` (``quantize``) and its settings (``config``),
calibrated GPTQ (``calibrate``), the automatic recipe's widths (``recipe``), the residual rotation,
calibration text and evaluation passes."""
