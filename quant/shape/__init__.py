"""Model shapes and the memory arithmetic: pure functions of a model's dimensions (no torch at import),
imported by the build, the runtime and the server alike."""
