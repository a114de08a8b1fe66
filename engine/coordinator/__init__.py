"""The coordinator: the request table, admission, routing and the KV hand-off between units."""
