"""The target worker: hosts the large model and verifies drafts."""
