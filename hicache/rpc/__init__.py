"""The wire: generated protobuf and gRPC code (generated/, made by scripts/gen_proto.py from
proto/hicache/v1/hicache.proto, never edited by hand) and the conversions between its
messages and hicache's own types (convert.py). Imported by the client and the server only."""
