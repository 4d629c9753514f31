"""Generated gRPC stubs of protos/quantserve (scripts/gen_protos.sh); no torch here."""
