"""The HTTP service (Starlette + uvicorn) on top of mbd_jax.engine. Not built yet: see the service issue."""
