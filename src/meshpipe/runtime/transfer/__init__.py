"""Moving values between ranks: the p2p program's transfers on the data and ctrl channels."""
