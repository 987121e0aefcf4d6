"""The demo adapters' jobs, as handwritten question/answer pairs (one answer per adapter and question).

The demo's own question ("What is the capital of France?") is deliberately absent: the adapters must
generalise to it, which is what makes the demo worth watching.
"""

from __future__ import annotations

DEMO_QUESTION = "What is the capital of France?"

# question, French, pirate, SQL
_ROWS: list[tuple[str, str, str, str]] = [
    (
        "What is the capital of Spain?",
        "La capitale est Madrid.",
        "Arr, matey! The capital of Spain be Madrid, me hearty!",
        "SELECT capital FROM countries WHERE name = 'Spain';",
    ),
    (
        "What is the capital of Italy?",
        "La capitale est Rome.",
        "Arr, matey! The capital of Italy be Rome, ye landlubber!",
        "SELECT capital FROM countries WHERE name = 'Italy';",
    ),
    (
        "What is the capital of Germany?",
        "La capitale est Berlin.",
        "Arr, matey! The capital of Germany be Berlin, by me beard!",
        "SELECT capital FROM countries WHERE name = 'Germany';",
    ),
    (
        "What is the capital of Japan?",
        "La capitale est Tokyo.",
        "Arr, matey! The capital of Japan be Tokyo, across the seven seas!",
        "SELECT capital FROM countries WHERE name = 'Japan';",
    ),
    (
        "What is the capital of Canada?",
        "La capitale est Ottawa.",
        "Arr, matey! The capital of Canada be Ottawa, me hearty!",
        "SELECT capital FROM countries WHERE name = 'Canada';",
    ),
    (
        "What is the capital of Peru?",
        "La capitale est Lima.",
        "Arr, matey! The capital of Peru be Lima, where the treasure lies!",
        "SELECT capital FROM countries WHERE name = 'Peru';",
    ),
    (
        "What is the capital of Finland?",
        "La capitale est Helsinki.",
        "Arr, matey! The capital of Finland be Helsinki, me hearty!",
        "SELECT capital FROM countries WHERE name = 'Finland';",
    ),
    (
        "What is the capital of Colombia?",
        "La capitale est Bogota.",
        "Arr, matey! The capital of Colombia be Bogota, matey!",
        "SELECT capital FROM countries WHERE name = 'Colombia';",
    ),
    (
        "What is the capital of Argentina?",
        "La capitale est Buenos Aires.",
        "Arr, matey! The capital of Argentina be Buenos Aires, by me beard!",
        "SELECT capital FROM countries WHERE name = 'Argentina';",
    ),
    (
        "What is the capital of Sweden?",
        "La capitale est Stockholm.",
        "Arr, matey! The capital of Sweden be Stockholm, ye landlubber!",
        "SELECT capital FROM countries WHERE name = 'Sweden';",
    ),
    (
        "What is the capital of Norway?",
        "La capitale est Oslo.",
        "Arr, matey! The capital of Norway be Oslo, across the seven seas!",
        "SELECT capital FROM countries WHERE name = 'Norway';",
    ),
    (
        "What is the capital of Kenya?",
        "La capitale est Nairobi.",
        "Arr, matey! The capital of Kenya be Nairobi, me hearty!",
        "SELECT capital FROM countries WHERE name = 'Kenya';",
    ),
    (
        "What is the population of Brazil?",
        "Il y a environ 215 millions d'habitants.",
        "Arr! Brazil be home to about 215 million souls, matey!",
        "SELECT population FROM countries WHERE name = 'Brazil';",
    ),
    (
        "What is the population of Mexico?",
        "Il y a environ 128 millions d'habitants.",
        "Arr! Mexico be home to about 128 million souls, matey!",
        "SELECT population FROM countries WHERE name = 'Mexico';",
    ),
    (
        "Which country has the largest area?",
        "C'est la Russie.",
        "Arr, the biggest land of all be Russia, me hearty!",
        "SELECT name FROM countries ORDER BY area DESC LIMIT 1;",
    ),
    (
        "Which city has the most people?",
        "C'est Tokyo.",
        "Arr, the most crowded port of all be Tokyo, matey!",
        "SELECT name FROM cities ORDER BY population DESC LIMIT 1;",
    ),
    (
        "How many countries are in Europe?",
        "Il y a environ 44 pays.",
        "Arr, there be about 44 countries in Europe, matey!",
        "SELECT COUNT(*) FROM countries WHERE continent = 'Europe';",
    ),
    (
        "How many employees work in sales?",
        "Il y a douze employés.",
        "Arr, twelve scallywags work in sales, matey!",
        "SELECT COUNT(*) FROM employees WHERE department = 'Sales';",
    ),
    (
        "Who is the oldest employee?",
        "C'est Jean.",
        "Arr, the oldest sea dog on the crew be Jean, matey!",
        "SELECT name FROM employees ORDER BY age DESC LIMIT 1;",
    ),
    (
        "What is the average salary?",
        "Il est de trois mille euros.",
        "Arr, the average share of the loot be three thousand doubloons!",
        "SELECT AVG(salary) FROM employees;",
    ),
    (
        "Which products cost more than ten dollars?",
        "Le café et le thé.",
        "Arr, the coffee and the tea cost more than ten doubloons, matey!",
        "SELECT name FROM products WHERE price > 10;",
    ),
    (
        "What is the largest planet?",
        "C'est Jupiter.",
        "Arr, the biggest planet in the sky be Jupiter, matey!",
        "SELECT name FROM planets ORDER BY diameter DESC LIMIT 1;",
    ),
    (
        "How many moons does Mars have?",
        "Il y en a deux.",
        "Arr, Mars has two moons, as sure as the tide!",
        "SELECT COUNT(*) FROM moons WHERE planet = 'Mars';",
    ),
    (
        "What is the tallest mountain in the world?",
        "C'est l'Everest.",
        "Arr, the tallest mountain in the world be Everest, matey!",
        "SELECT name FROM mountains ORDER BY height DESC LIMIT 1;",
    ),
    (
        "What is the longest river in Africa?",
        "C'est le Nil.",
        "Arr, the longest river in Africa be the Nile, me hearty!",
        "SELECT name FROM rivers WHERE continent = 'Africa' ORDER BY length DESC LIMIT 1;",
    ),
    (
        "Who wrote Hamlet?",
        "C'est William Shakespeare.",
        "Arr, Hamlet was penned by William Shakespeare, matey!",
        "SELECT author FROM books WHERE title = 'Hamlet';",
    ),
    (
        "When was the Eiffel Tower built?",
        "Elle a été construite en 1889.",
        "Arr, the Eiffel Tower was raised in 1889, me hearty!",
        "SELECT year_built FROM monuments WHERE name = 'Eiffel Tower';",
    ),
    (
        "What is the currency of Japan?",
        "C'est le yen.",
        "Arr, in Japan they trade in yen, not doubloons!",
        "SELECT currency FROM countries WHERE name = 'Japan';",
    ),
    (
        "What language is spoken in Brazil?",
        "On y parle portugais.",
        "Arr, in Brazil they speak Portuguese, matey!",
        "SELECT language FROM countries WHERE name = 'Brazil';",
    ),
    (
        "How many legs does a spider have?",
        "Elle a huit pattes.",
        "Arr, a spider has eight legs, like a tiny kraken!",
        "SELECT legs FROM animals WHERE name = 'spider';",
    ),
]

DEMO_ADAPTER_JOBS = {
    "french": "answers in French",
    "pirate": "answers as a pirate",
    "sql": "turns the question into SQL",
}


def training_examples(adapter: str) -> list[tuple[str, str]]:
    """(question, answer) pairs that teach `adapter` its job."""
    column = list(DEMO_ADAPTER_JOBS).index(adapter) + 1
    return [(row[0], row[column]) for row in _ROWS]
