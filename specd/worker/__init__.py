"""What the two model workers share: settings, the servicer base, start-up."""
