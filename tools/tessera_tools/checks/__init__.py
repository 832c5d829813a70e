"""Checks of the repository that meson runs as tests: every header compiles on its own and the
include graph flows one way (headers), docs/api.md names every public type (api_docs), and the
negative-compilation sources fail with their sentence (compile_fail)."""
