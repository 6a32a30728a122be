"""Images in the shared layer store: importing and building them (never pulled), the
Debian sandbox image, the platform's own images, and what the store holds."""
