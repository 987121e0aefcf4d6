"""Model building blocks: linear (plain and packed), paged attention, rotary, norm, embedding."""
