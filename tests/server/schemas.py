"""JSON schemas of the shapes applications send (nested objects, arrays, enums, bounded
numbers, required fields, anyOf), with a prompt that asks for each."""

from __future__ import annotations

STRING = {"type": "string", "maxLength": 24}
SCHEMAS: dict[str, tuple[str, dict]] = {
    "person": (
        "Describe a person.",
        {
            "type": "object",
            "properties": {"name": STRING, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
        },
    ),
    "city": (
        "Name a city and its country.",
        {"type": "object", "properties": {"city": STRING, "country": STRING}, "required": ["city", "country"]},
    ),
    "colors": (
        "List three colors.",
        {
            "type": "object",
            "properties": {"colors": {"type": "array", "items": STRING, "minItems": 3, "maxItems": 3}},
            "required": ["colors"],
        },
    ),
    "sentiment": (
        "Classify the sentiment of: I love this phone.",
        {
            "type": "object",
            "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
            "required": ["sentiment"],
        },
    ),
    "rating": (
        "Rate a movie from 1 to 5.",
        {
            "type": "object",
            "properties": {"title": STRING, "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["title", "stars"],
        },
    ),
    "temperature": (
        "Give today's temperature in Celsius.",
        {
            "type": "object",
            "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
            "required": ["celsius"],
        },
    ),
    "boolean": (
        "Is water wet?",
        {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    ),
    "address": (
        "Write a postal address.",
        {
            "type": "object",
            "properties": {
                "street": STRING,
                "number": {"type": "integer", "minimum": 1, "maximum": 9999},
                "city": STRING,
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "number", "city", "zip"],
        },
    ),
    "nested": (
        "Describe a company and its founder.",
        {
            "type": "object",
            "properties": {
                "company": STRING,
                "founder": {
                    "type": "object",
                    "properties": {"name": STRING, "born": {"type": "integer", "minimum": 1800, "maximum": 2020}},
                    "required": ["name", "born"],
                },
            },
            "required": ["company", "founder"],
        },
    ),
    "array_of_objects": (
        "List two books with their authors.",
        {
            "type": "object",
            "properties": {
                "books": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"title": STRING, "author": STRING},
                        "required": ["title", "author"],
                    },
                    "minItems": 2,
                    "maxItems": 2,
                }
            },
            "required": ["books"],
        },
    ),
    "anyof": (
        "Describe a shape.",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"circle_radius": {"type": "integer", "minimum": 1, "maximum": 100}},
                    "required": ["circle_radius"],
                },
                {
                    "type": "object",
                    "properties": {"square_side": {"type": "integer", "minimum": 1, "maximum": 100}},
                    "required": ["square_side"],
                },
            ]
        },
    ),
    "nullable": (
        "Give a nickname, if any.",
        {"type": "object", "properties": {"nickname": {"anyOf": [STRING, {"type": "null"}]}}, "required": ["nickname"]},
    ),
    "enum_list": (
        "Pick the days of a weekend.",
        {
            "type": "object",
            "properties": {
                "days": {
                    "type": "array",
                    "items": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]},
                    "minItems": 1,
                    "maxItems": 2,
                }
            },
            "required": ["days"],
        },
    ),
    "integers": (
        "Give three small numbers.",
        {
            "type": "object",
            "properties": {
                "numbers": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 3,
                    "maxItems": 3,
                }
            },
            "required": ["numbers"],
        },
    ),
    "const": (
        "Report the status.",
        {
            "type": "object",
            "properties": {"status": {"const": "ok"}, "code": {"type": "integer", "minimum": 100, "maximum": 599}},
            "required": ["status", "code"],
        },
    ),
    "recipe": (
        "Write a short recipe.",
        {
            "type": "object",
            "properties": {
                "dish": STRING,
                "minutes": {"type": "integer", "minimum": 1, "maximum": 240},
                "vegetarian": {"type": "boolean"},
                "ingredients": {"type": "array", "items": STRING, "minItems": 1, "maxItems": 3},
            },
            "required": ["dish", "minutes", "vegetarian", "ingredients"],
        },
    ),
    "event": (
        "Plan a meeting.",
        {
            "type": "object",
            "properties": {
                "topic": STRING,
                "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
                "attendees": {"type": "integer", "minimum": 2, "maximum": 20},
            },
            "required": ["topic", "date", "attendees"],
        },
    ),
    "coordinates": (
        "Give the coordinates of a place.",
        {
            "type": "object",
            "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
            },
            "required": ["lat", "lon"],
        },
    ),
    "translation": (
        "Translate hello into French.",
        {
            "type": "object",
            "properties": {"source": STRING, "target": STRING, "language": {"enum": ["fr", "de", "es"]}},
            "required": ["source", "target", "language"],
        },
    ),
    "matrix": (
        "Write a 2x2 matrix.",
        {
            "type": "object",
            "properties": {
                "rows": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": -9, "maximum": 9},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 2,
                    "maxItems": 2,
                }
            },
            "required": ["rows"],
        },
    ),
    "strict_object": (
        "Describe a pet.",
        {
            "type": "object",
            "properties": {"species": {"enum": ["cat", "dog", "fish"]}, "name": STRING},
            "required": ["species", "name"],
            "additionalProperties": False,
        },
    ),
    "top_level_array": (
        "List two fruits.",
        {"type": "array", "items": STRING, "minItems": 2, "maxItems": 2},
    ),
}
