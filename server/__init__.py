"""quantserve's inference engine and transports (issues #4 and #5)."""
