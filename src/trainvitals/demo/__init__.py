"""The demo: a small CNN on scikit-learn's bundled handwritten digits, with trainvitals attached."""
