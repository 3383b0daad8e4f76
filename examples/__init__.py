"""Examples of jaxflash; run them from the repository root with python -m."""
