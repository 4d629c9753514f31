"""The quantserve-client distribution: the generated gRPC stubs (quantserve.v1, from protos/ by
scripts/gen_protos.sh) and the client on top of them (quantserve.client). No torch here."""
