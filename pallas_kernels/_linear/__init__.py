"""The quantised linear: the op (`api`), its contract (`base`), reference and backends."""
