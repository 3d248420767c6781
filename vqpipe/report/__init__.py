"""The report: records -> figures (``summary``, no MLX) -> plots (``plots``) and pages (``render``,
``templates/``)."""
