"""Graph-wide strategies: fuse, token split (TokenWeave) and FlashComm."""
