"""quantserve's inference engine and its transports (gRPC, OpenAI-compatible HTTP)."""
