"""What the daemon measures of itself and its engines, and its metrics and logs."""
