"""Planning-time cost of the context-parallel exchange (placeholder until filled in)."""


def register() -> None:
    pass
