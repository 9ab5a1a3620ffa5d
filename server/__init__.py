"""The HTTP front end: an OpenAI-compatible FastAPI app over an `EngineClient`, plus the CLI.

Imports only `engine` and `configs` (never `scheduler` or `cache`); holds no engine state.
"""
