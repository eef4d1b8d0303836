"""kimi-vision-triton: all logic behind the Triton models. Each `model_repository/*/1/model.py` is a thin
adapter over `backends.serving`; everything here can be imported and tested without a server."""
