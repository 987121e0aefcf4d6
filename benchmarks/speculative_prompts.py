"""The speculative benchmark's workloads (benchmarks/speculative.py): copying prompts (the demo SQL
adapter's questions, JSON extraction, text editing), free chat, the demo adapters' questions for the
16-adapter row, and each row's target (issue 40: copying rows >= 2x, chat >= 0.97x, 16 adapters >= 1.0x)."""

from __future__ import annotations

TARGETS = {"sql": 2.0, "json": 2.0, "edit": 2.0, "chat": 0.97, "16 adapters": 1.0}
_TEXT = (
    "Our billing service moved to a new data centre on Monday 3 March, after three weeks of testing in staging. "
    "Customers in Europe will see their invoices in euros, while customers in the United States keep paying in "
    "dollars. Please contact support@example.com if you notice any problem with your account or your invoices."
)
_CLINIC = (
    "Dr. Smith opened the clinic at eight in the morning. Dr. Smith checked the list of appointments, called "
    "the first patient and wrote the prescriptions for the pharmacy on the corner of Elm Street and Main Street."
)
PROMPTS: dict[str, list[str]] = {
    "sql": [  # the demo SQL adapter's questions, naming the tables and columns its query copies
        "Which rows of the table customer_orders have order_status 'shipped' and total_amount above 100?",
        "List first_name, last_name and hire_date from the table employees where department_name is 'Sales'.",
        "Which products in the table inventory_items have stock_count below reorder_level?",
    ],
    "json": [
        "Extract the name, email, phone and city of each person as a JSON list of objects with the keys name, "
        "email, phone, city.\n\nAlice Martin (alice.martin@example.com, +33 6 12 34 56 78) lives in Lyon. "
        "Bob Chen (bob.chen@example.org, +1 415 555 0134) lives in San Francisco. Carla Diaz "
        "(carla.diaz@example.net, +34 612 345 678) lives in Madrid.",
        "Convert this list to JSON with the keys product, price and quantity:\n- Ergonomic Office Chair, 189.50, 12\n"
        "- Standing Desk Converter, 249.00, 4\n- Wireless Keyboard and Mouse Set, 59.99, 30\n"
        "- Noise Cancelling Headphones, 129.00, 8",
    ],
    "edit": [
        "Repeat this text word for word, but replace 'euros' with 'pounds':\n\n" + _TEXT,
        "Repeat this paragraph word for word, but replace 'Dr. Smith' with 'Dr. Jones':\n\n" + _CLINIC,
    ],
    "chat": [
        "Tell me a short story about a robot who learns to cook.",
        "What are some good habits for staying productive when working from home?",
    ],
}
ADAPTER_QUESTIONS = {  # the demo adapters' jobs (SQL, French, pirate) on questions they were not trained on
    "sql": "Which products in the table inventory have stock_count below reorder_level?",
    "french": "What is the capital of Portugal?",
    "pirate": "What is the largest ocean on Earth?",
}
