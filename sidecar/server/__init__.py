"""The daemon's gRPC services and process lifecycle."""
