"""Paged decode attention: the op (`api`), its pure-jnp reference and its Triton backend."""
