"""Host-engine adapters. Each imports its engine lazily; the core never imports them."""
