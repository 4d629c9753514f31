"""The artifact format and model sources: reading and writing artifacts (manifest, hashes, shards), a checkpoint's
config, and where a model comes from (a local dir, a GGUF file, a hub id). Imports only quant.shape and quant.errors."""
