"""partc's command-line interface: parses options and calls the partc library, nothing more."""
