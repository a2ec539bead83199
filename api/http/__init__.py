"""The HTTP edge: Litestar controllers, bearer-token guards, the one problem+json mapping of the
services' errors, and the server process (uvicorn, lifespan)."""
