"""The decision core: identity → body → model ACL → admission. No gRPC, no Redis here."""
