"""transfuse"""
