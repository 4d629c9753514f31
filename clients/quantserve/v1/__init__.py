"""Generated gRPC stubs of protos/quantserve/v1 (scripts/gen_protos.sh); no torch here."""
