"""The draft worker: hosts the small model and proposes drafts."""
