"""quantserve clients. Never imports torch: a user runs them on a laptop against a remote server."""
