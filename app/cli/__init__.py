"""Every `dsec` command, and the tables and reports it renders."""
