"""The wire: proto <-> core conversion and the checks every service applies (the generated stubs are specd.v1)."""
