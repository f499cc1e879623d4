"""Build the mini WebShop catalogue and goals (envs/webshop_data/{products,goals}.json).

The real WebShop (Yao et al. 2022) scrapes 1.18 M Amazon products and cannot be downloaded here, so the
project ships its own small shop in WebShop's schema: every product has an ASIN, a
Title, a short `name`, the `type_nouns` of that name (WebShop parses them with spaCy), an Amazon-style
`product_category` ("A › B › C"), the search `query` it was "scraped" with, Attributes, BulletPoints, a
Description, a price and option groups. A goal names one product and asks for 1-3 of its attributes, one
value per option group and a price cap above its price, phrased like WebShop's human instructions.

Splits: products are split per category into a train pool and unseen products (never targeted by a train
goal); `train` and `seen` goals target train-pool products (different goals), `unseen` goals target the
unseen products.

Everything comes from the seed lists below and one fixed-seed random generator, so

    python envs/webshop_build.py            # rewrites envs/webshop_data/*.json byte for byte
    python envs/webshop_build.py --out DIR  # writes elsewhere (the tests compare the two)
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from envs.webshop_reward import option_matches  # noqa: E402  (the reward's own option test)

SEED = 20240917
PER_KIND = 12          # products per kind: 6 categories x 5 kinds x 12 = 360 products
UNSEEN_PER_CATEGORY = 10
TRAIN_GOALS_PER_PRODUCT = 3
N_SEEN, N_UNSEEN = 200, 200
OUT_DIR = Path(__file__).resolve().parent / "webshop_data"

# Attribute seeds: each inner list holds mutually exclusive alternatives; a product takes one from some of
# them. "with:x" / "for:x" store attribute x and phrase it after the product name ("... with x").
# Option groups: (group, values, contiguous) - contiguous groups (sizes) take a window of the ordered list.
CATEGORIES = {
    "clothing": {
        "brands": ["Calder & Co", "Northline", "Maple Row", "Urban Thread", "Kestrel", "Harbor Lane", "Oakridge",
                   "Verano"],
        "kinds": [
            dict(name="men's dress shirt", title="Men's Dress Shirt", nouns=["dress", "shirt"],
                 query="men's dress shirts", path="Clothing, Shoes & Jewelry › Men › Clothing › Shirts › Dress Shirts",
                 attrs=[["long sleeve", "short sleeve"], ["slim fit", "regular fit"], ["wrinkle free"],
                        ["button down collar", "spread collar"], ["machine wash"], ["stretch fabric"]],
                 options=[("size", ["small", "medium", "large", "x-large", "xx-large"], True),
                          ("color", ["white", "light blue", "pink", "lavender", "charcoal", "black"], False)],
                 price=(18, 45), blurb="Tailored for the office and easy to care for."),
            dict(name="women's yoga leggings", title="Women's Yoga Leggings", nouns=["yoga", "leggings"], plural=True,
                 query="women's yoga leggings", path="Clothing, Shoes & Jewelry › Women › Clothing › Active › Leggings",
                 attrs=[["high waist", "mid rise"], ["tummy control"], ["squat proof"],
                        ["moisture wicking", "quick dry"], ["with:side pockets"], ["4 way stretch"]],
                 options=[("size", ["x-small", "small", "medium", "large", "x-large"], True),
                          ("color", ["black", "navy", "heather gray", "olive", "burgundy", "teal"], False)],
                 price=(15, 40), blurb="Soft, opaque fabric that moves with you in every pose."),
            dict(name="men's hoodie", title="Men's Hoodie", nouns=["hoodie"],
                 query="men's hoodies",
                 path="Clothing, Shoes & Jewelry › Men › Clothing › Fashion Hoodies & Sweatshirts",
                 attrs=[["pullover", "full zip"], ["fleece lined"], ["with:kangaroo pocket"], ["with:drawstring hood"],
                        ["cotton blend"], ["ribbed cuffs"]],
                 options=[("size", ["small", "medium", "large", "x-large", "xx-large", "3x-large"], True),
                          ("color", ["black", "charcoal", "navy", "forest green", "maroon", "oatmeal"], False)],
                 price=(20, 55), blurb="A warm everyday layer for cool mornings."),
            dict(name="women's summer dress", title="Women's Summer Dress", nouns=["summer", "dress"],
                 query="women's summer dresses", path="Clothing, Shoes & Jewelry › Women › Clothing › Dresses › Casual",
                 attrs=[["short sleeve", "sleeveless"], ["v neck", "crew neck"], ["floral print", "polka dot"],
                        ["with:pockets"], ["midi length", "maxi length", "knee length"], ["flowy"]],
                 options=[("size", ["small", "medium", "large", "x-large"], True),
                          ("color", ["black", "white", "yellow", "coral", "sage green", "dusty pink"], False)],
                 price=(20, 50), blurb="Light and airy for warm days, beach trips and brunch."),
            dict(name="boys' winter jacket", title="Boys' Winter Jacket", nouns=["winter", "jacket"],
                 query="boys winter jackets", path="Clothing, Shoes & Jewelry › Boys › Clothing › Jackets & Coats",
                 attrs=[["water resistant", "waterproof"], ["hooded"], ["fleece lined"], ["lightweight"],
                        ["zip closure"], ["with:reflective strips"]],
                 options=[("size", ["4t", "5t", "6", "8", "10", "12", "14"], True),
                          ("color", ["red", "navy", "black", "royal blue", "green camo"], False)],
                 price=(30, 70), blurb="Keeps kids warm and dry on the way to school."),
        ],
    },
    "shoes": {
        "brands": ["Stridewell", "Peakform", "Trailmark", "Solecraft", "Haven Step", "Ironbark", "Pebble & Pine",
                   "Quickfoot"],
        "kinds": [
            dict(name="men's running shoes", title="Men's Running Shoes", nouns=["running", "shoes"], plural=True,
                 query="men's running shoes", path="Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
                 attrs=[["lightweight"], ["breathable mesh"], ["rubber sole"], ["with:memory foam insole"],
                        ["non slip"], ["lace up", "slip on"]],
                 options=[("size", ["7", "7.5", "8", "8.5", "9", "9.5", "10", "10.5", "11", "12"], True),
                          ("color", ["black", "white", "grey", "navy", "red", "olive"], False)],
                 price=(35, 90), blurb="Cushioned for long runs and daily training."),
            dict(name="women's sandals", title="Women's Sandals", nouns=["sandals"], plural=True,
                 query="women's sandals", path="Clothing, Shoes & Jewelry › Women › Shoes › Sandals",
                 attrs=[["open toe"], ["with:ankle strap"], ["with:arch support"], ["flat sole", "wedge heel"],
                        ["with:adjustable buckle"], ["cushioned footbed"]],
                 options=[("size", ["6", "6.5", "7", "7.5", "8", "8.5", "9", "10"], True),
                          ("color", ["black", "tan", "white", "gold", "blush"], False)],
                 price=(20, 60), blurb="Comfortable summer sandals for walking all day."),
            dict(name="men's work boots", title="Men's Work Boots", nouns=["work", "boots"], plural=True,
                 query="men's work boots", path="Clothing, Shoes & Jewelry › Men › Shoes › Boots › Work & Safety",
                 attrs=[["steel toe", "composite toe", "soft toe"], ["waterproof"], ["slip resistant"],
                        ["oil resistant"], ["6 inch", "8 inch"], ["leather upper"]],
                 options=[("size", ["8", "8.5", "9", "9.5", "10", "10.5", "11", "11.5", "12", "13"], True),
                          ("color", ["brown", "black", "wheat", "gray"], False)],
                 price=(60, 150), blurb="Built tough for job sites and long shifts."),
            dict(name="women's slippers", title="Women's Slippers", nouns=["slippers"], plural=True,
                 query="women's house slippers", path="Clothing, Shoes & Jewelry › Women › Shoes › Slippers",
                 attrs=[["memory foam"], ["fuzzy", "plush"], ["anti skid sole"], ["indoor outdoor"],
                        ["open toe", "closed toe"], ["machine washable"]],
                 options=[("size", ["5-6", "7-8", "9-10", "11-12"], True),
                          ("color", ["pink", "gray", "black", "beige", "wine"], False)],
                 price=(12, 35), blurb="Cozy slippers for lazy mornings at home."),
            dict(name="kids' sneakers", title="Kids' Sneakers", nouns=["sneakers"], plural=True,
                 query="kids sneakers", path="Clothing, Shoes & Jewelry › Boys › Shoes › Sneakers",
                 attrs=[["light up"], ["hook and loop", "lace up"], ["non slip"], ["breathable"], ["lightweight"],
                        ["easy on"]],
                 options=[("size", ["10 toddler", "11 toddler", "12 little kid", "13 little kid", "1 big kid",
                                    "2 big kid", "3 big kid"], True),
                          ("color", ["blue", "black", "pink", "white", "green"], False)],
                 price=(18, 50), blurb="Fun, sturdy sneakers for school and play."),
        ],
    },
    "beauty": {
        "brands": ["Lumiere Lab", "Pure Fern", "Velvetine", "Skinwise", "Amberleaf", "Nordic Dew", "Rosewater Co",
                   "Glowtide"],
        "kinds": [
            dict(name="face moisturizer", title="Face Moisturizer", nouns=["face", "moisturizer"],
                 query="face moisturizer", path="Beauty & Personal Care › Skin Care › Face › Creams & Moisturizers",
                 attrs=[["with:hyaluronic acid"], ["fragrance free"], ["oil free"], ["with:spf 30"],
                        ["for:sensitive skin", "for:dry skin", "for:oily skin"], ["cruelty free"], ["non comedogenic"]],
                 options=[("size", ["1 fl oz", "1.7 fl oz", "2.5 fl oz", "3.4 fl oz"], True)],
                 price=(12, 40), blurb="Daily hydration that leaves skin smooth and soft."),
            dict(name="shampoo", title="Shampoo", nouns=["shampoo"],
                 query="shampoo", path="Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
                 attrs=[["sulfate free"], ["vegan"],
                        ["for:curly hair", "for:color treated hair", "for:thinning hair"],
                        ["with:argan oil", "with:tea tree oil", "with:coconut oil"]],
                 options=[("size", ["8 fl oz", "12 fl oz", "16 fl oz", "33.8 fl oz"], True),
                          ("scent", ["lavender", "citrus", "peppermint", "unscented", "rosemary"], False)],
                 price=(8, 30), blurb="Cleans gently without stripping natural oils."),
            dict(name="lipstick", title="Lipstick", nouns=["lipstick"],
                 query="lipstick", path="Beauty & Personal Care › Makeup › Lips › Lipstick",
                 attrs=[["matte finish", "satin finish", "glossy finish"], ["long lasting"], ["moisturizing"],
                        ["transfer proof"], ["vegan"], ["cruelty free"]],
                 options=[("color", ["ruby", "mauve", "nude", "coral", "berry", "plum", "brick"], False)],
                 price=(8, 25), blurb="Rich color in a single swipe."),
            dict(name="body lotion", title="Body Lotion", nouns=["body", "lotion"],
                 query="body lotion", path="Beauty & Personal Care › Skin Care › Body › Lotions",
                 attrs=[["with:shea butter", "with:cocoa butter", "with:aloe vera"], ["fast absorbing"], ["non greasy"],
                        ["for:dry skin", "for:sensitive skin"], ["paraben free"], ["dermatologist tested"]],
                 options=[("size", ["8 fl oz", "13.5 fl oz", "20 fl oz"], True),
                          ("scent", ["unscented", "vanilla", "lavender", "cucumber melon", "coconut"], False)],
                 price=(6, 25), blurb="Locks in moisture for up to 24 hours."),
            dict(name="nail polish", title="Nail Polish", nouns=["nail", "polish"],
                 query="nail polish",
                 path="Beauty & Personal Care › Foot, Hand & Nail Care › Nail Art & Polish › Nail Polish",
                 attrs=[["quick dry"], ["long lasting"], ["chip resistant"], ["gel effect"], ["non toxic"],
                        ["high shine"]],
                 options=[("color", ["cherry red", "ballet pink", "navy", "emerald", "lilac", "jet black"], False),
                          ("size", ["0.5 fl oz", "pack of 2", "pack of 3"], True)],
                 price=(5, 18), blurb="Salon quality color at home."),
        ],
    },
    "grocery": {
        "brands": ["Golden Acre", "Hillside Pantry", "Sunny Meadow", "Blue Heron Farms", "Wildroot", "Copper Kettle",
                   "Nature's Table", "Harvest Lane"],
        "kinds": [
            dict(name="green tea bags", title="Green Tea Bags", nouns=["tea", "bags"], plural=True,
                 query="green tea bags", path="Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Tea › Green",
                 attrs=[["organic"], ["non gmo"], ["individually wrapped"], ["kosher"], ["with:antioxidants"],
                        ["unsweetened"]],
                 options=[("flavor name", ["jasmine", "mint", "lemon ginger", "honey", "peach", "matcha"], False),
                          ("size", ["20 count (pack of 1)", "20 count (pack of 6)", "100 count"], True)],
                 price=(5, 25), blurb="A smooth, refreshing cup any time of day."),
            dict(name="protein bars", title="Protein Bars", nouns=["protein", "bars"], plural=True,
                 query="protein bars", path="Grocery & Gourmet Food › Snack Foods › Bars › Protein",
                 attrs=[["gluten free"], ["high protein"], ["low sugar"], ["keto friendly"], ["non gmo"],
                        ["plant based"]],
                 options=[("flavor name", ["chocolate peanut butter", "cookies and cream", "salted caramel",
                                           "birthday cake", "blueberry almond"], False),
                          ("size", ["12 count", "15 count", "24 count"], True)],
                 price=(15, 40), blurb="A filling snack before or after a workout."),
            dict(name="ground coffee", title="Ground Coffee", nouns=["coffee"],
                 query="ground coffee",
                 path="Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Coffee › Ground Coffee",
                 attrs=[["medium roast", "dark roast", "light roast"], ["100% arabica"], ["fair trade"], ["organic"],
                        ["low acid"]],
                 options=[("flavor name", ["original", "french vanilla", "hazelnut", "mocha", "caramel"], False),
                          ("size", ["12 ounce", "24 ounce", "32 ounce"], True)],
                 price=(8, 30), blurb="Freshly roasted for a full-bodied cup."),
            dict(name="mixed nuts", title="Mixed Nuts", nouns=["nuts"], plural=True,
                 query="mixed nuts", path="Grocery & Gourmet Food › Snack Foods › Nuts & Seeds › Mixed Nuts",
                 attrs=[["unsalted", "lightly salted"], ["roasted", "raw"], ["non gmo"], ["keto friendly"],
                        ["resealable bag"], ["gluten free"]],
                 options=[("size", ["16 ounce", "24 ounce", "40 ounce", "16 ounce (pack of 2)"], True)],
                 price=(9, 30), blurb="Cashews, almonds, pecans and more in every handful."),
            dict(name="olive oil", title="Olive Oil", nouns=["olive", "oil"],
                 query="extra virgin olive oil", path="Grocery & Gourmet Food › Pantry Staples › Cooking Oils › Olive",
                 attrs=[["extra virgin"], ["cold pressed"], ["organic"], ["non gmo"], ["glass bottle"],
                        ["single origin"]],
                 options=[("size", ["16.9 fl oz", "25.3 fl oz", "33.8 fl oz", "68 fl oz"], True),
                          ("flavor name", ["classic", "garlic infused", "lemon infused"], False)],
                 price=(9, 35), blurb="Fruity and peppery, for dressings and cooking."),
        ],
    },
    "electronics": {
        "brands": ["Voltaro", "Soundmere", "Pixelon", "Zentrix", "Auralink", "Cobalt Labs", "Nimbus Tech", "Kairo"],
        "kinds": [
            dict(name="wireless earbuds", title="Wireless Earbuds", nouns=["earbuds"], plural=True,
                 query="wireless earbuds",
                 path="Electronics › Headphones, Earbuds & Accessories › Headphones › Earbud Headphones",
                 attrs=[["noise cancelling"], ["bluetooth 5.3"], ["waterproof", "sweat resistant"],
                        ["with:long battery life"], ["with:wireless charging case"], ["with:built in microphone"]],
                 options=[("color", ["black", "white", "navy", "rose gold", "sage"], False)],
                 price=(20, 90), blurb="Clear sound and a secure fit for workouts and commutes."),
            dict(name="phone case", title="Phone Case", nouns=["phone", "case"],
                 query="phone case",
                 path="Electronics › Cell Phones & Accessories › Cases, Holsters & Clips › Basic Cases",
                 attrs=[["shockproof"], ["slim"], ["magsafe compatible"], ["with:kickstand"], ["with:raised edges"],
                        ["anti yellowing"]],
                 options=[("style", ["iphone 14", "iphone 15 pro max", "pixel 8", "galaxy s24"], False),
                          ("color", ["black", "clear", "purple", "green", "blue"], False)],
                 price=(8, 30), blurb="Everyday protection that keeps your phone looking new."),
            dict(name="usb c wall charger", title="USB C Wall Charger", nouns=["wall", "charger"],
                 query="usb c charger",
                 path="Electronics › Computers & Accessories › Cables & Accessories › Chargers & Adapters",
                 attrs=[["fast charging"], ["foldable plug"], ["gan technology"], ["dual port", "single port"],
                        ["compact"], ["with:overheat protection"]],
                 options=[("style", ["20w", "30w", "45w", "65w"], False), ("color", ["white", "black"], False)],
                 price=(10, 45), blurb="Charges phones, tablets and laptops at full speed."),
            dict(name="hdmi cable", title="HDMI Cable", nouns=["hdmi", "cable"],
                 query="hdmi cable",
                 path="Electronics › Accessories & Supplies › Audio & Video Accessories › Cables › HDMI Cables",
                 attrs=[["high speed"], ["braided"], ["gold plated"], ["4k hdr", "8k hdr"], ["with:ethernet"],
                        ["flexible"]],
                 options=[("size", ["3 feet", "6 feet", "10 feet", "15 feet", "25 feet", "6 feet (pack of 2)"], True)],
                 price=(6, 25), blurb="Sharp picture and sound for TVs, consoles and monitors."),
            dict(name="portable bluetooth speaker", title="Portable Bluetooth Speaker", nouns=["bluetooth", "speaker"],
                 query="portable bluetooth speaker",
                 path="Electronics › Portable Audio & Video › Portable Speakers & Docks › Portable Bluetooth Speakers",
                 attrs=[["waterproof"], ["24 hour playtime", "12 hour playtime"], ["deep bass"],
                        ["with:built in microphone"], ["dustproof"], ["stereo pairing"]],
                 options=[("color", ["black", "blue", "red", "gray", "teal"], False)],
                 price=(20, 80), blurb="Big sound for the beach, the park and the shower."),
        ],
    },
    "home_kitchen": {
        "brands": ["Hearthstone", "Linden & Lark", "Casa Verde", "Willow Home", "Driftwood", "Cozy Nest", "Ashgrove",
                   "Marlow"],
        "kinds": [
            dict(name="bed sheet set", title="Bed Sheet Set", nouns=["sheet", "set"],
                 query="bed sheet set",
                 path="Home & Kitchen › Bedding › Sheets & Pillowcases › Sheet & Pillowcase Sets",
                 attrs=[["deep pocket"], ["microfiber", "100% cotton", "bamboo"], ["hypoallergenic"], ["breathable"],
                        ["machine washable"], ["wrinkle resistant"]],
                 options=[("size", ["twin", "full", "queen", "king", "california king"], True),
                          ("color", ["white", "gray", "navy", "sage", "beige", "burgundy"], False)],
                 price=(20, 70), blurb="Soft, cool sheets for a better night's sleep."),
            dict(name="throw pillow covers", title="Throw Pillow Covers", nouns=["pillow", "covers"], plural=True,
                 query="throw pillow covers",
                 path="Home & Kitchen › Home Décor Products › Decorative Pillows, Inserts & Covers › Pillow Covers",
                 attrs=[["velvet", "linen", "faux fur"], ["with:hidden zipper"], ["machine washable"], ["double sided"],
                        ["set of 2"]],
                 options=[("size", ["16 x 16 inch", "18 x 18 inch", "20 x 20 inch", "24 x 24 inch"], True),
                          ("color", ["mustard yellow", "emerald green", "navy", "blush pink", "gray"], False)],
                 price=(10, 30), blurb="An easy way to refresh a sofa or bed."),
            dict(name="nonstick frying pan", title="Nonstick Frying Pan", nouns=["frying", "pan"],
                 query="nonstick frying pan",
                 path="Home & Kitchen › Kitchen & Dining › Cookware › Pots & Pans › Skillets",
                 attrs=[["induction compatible"], ["dishwasher safe"], ["oven safe"], ["pfoa free"],
                        ["with:stay cool handle"], ["with:glass lid"]],
                 options=[("size", ["8 inch", "10 inch", "12 inch", "8 and 10 inch set"], True),
                          ("color", ["black", "gray", "red", "blue"], False)],
                 price=(15, 60), blurb="Eggs and pancakes slide right off."),
            dict(name="ceramic mug", title="Ceramic Mug", nouns=["mug"],
                 query="ceramic mug",
                 path="Home & Kitchen › Kitchen & Dining › Dining & Entertaining › Cups, Mugs & Saucers › Mugs",
                 attrs=[["microwave safe"], ["dishwasher safe"], ["lead free"], ["with:large handle"], ["handmade"],
                        ["stackable"]],
                 options=[("size", ["12 oz", "16 oz", "20 oz", "16 oz (set of 2)"], True),
                          ("color", ["white", "black", "sage green", "terracotta", "sky blue"], False)],
                 price=(8, 30), blurb="A sturdy mug for coffee, tea and cocoa."),
            dict(name="scented candle", title="Scented Candle", nouns=["candle"],
                 query="scented candles", path="Home & Kitchen › Home Décor Products › Candles & Holders › Candles",
                 attrs=[["soy wax"], ["long burning"], ["lead free wick"], ["hand poured"], ["with:essential oils"],
                        ["gift ready"]],
                 options=[("scent", ["lavender", "vanilla bean", "eucalyptus", "sandalwood", "fresh linen",
                                     "pumpkin spice"], False),
                          ("size", ["8 oz", "14 oz", "3 wick 16 oz"], True)],
                 price=(10, 35), blurb="Fills the room with a warm, relaxing scent."),
        ],
    },
}

BENEFITS = ["made to last through daily use", "quality you can see and feel", "tested for comfort and durability",
            "a favorite with our customers", "designed with care in every detail", "great value for everyday use"]
REVIEW_TITLES = ["Great value", "Works as described", "Love it", "Pretty good", "Would buy again", "Nice quality",
                 "Just okay", "Exactly what I wanted"]
REVIEW_BODIES = ["Arrived quickly and looks just like the pictures.", "Good quality for the price.",
                 "I bought a second one for my family.", "Does the job, nothing fancy.",
                 "Better than the one I had before.", "Took a while to arrive but I am happy with it."]
LEADS = ["i need", "i want", "i am looking for", "i'm looking for", "find me", "i would like"]
OPTION_PHRASES = {"size": ["size {}", "in size {}"], "color": ["in {}", "in {} color", "color {}"],
                  "flavor name": ["{} flavor", "in {} flavor"], "scent": ["{} scent", "with {} scent"],
                  "style": ["for {}", "{} style"]}
UPPER = {"usb", "hdmi", "gan", "hdr", "spf", "4k", "8k", "20w", "30w", "45w", "65w"}


def split_attr(seed: str) -> tuple[str, str]:
    """'with:side pockets' -> ('side pockets', 'with'); 'slim fit' -> ('slim fit', '')."""
    prefix, _, attr = seed.rpartition(":")
    return attr, prefix


def title_case(text: str) -> str:
    return " ".join(w.upper() if w in UPPER else w[:1].upper() + w[1:] for w in text.split())


def pick_options(rng: random.Random, groups) -> dict[str, list[str]]:
    options = {}
    for group, values, contiguous in groups:
        if contiguous:
            n = rng.randint(3, len(values))
            start = rng.randint(0, len(values) - n)
            options[group] = values[start:start + n]
        else:
            chosen = set(rng.sample(values, rng.randint(min(3, len(values)), len(values))))
            options[group] = [v for v in values if v in chosen]
    return options


def options_distinct(options: dict[str, list[str]]) -> bool:
    """No value of a product may count as another under the reward's option test (else a wrong click scores)."""
    values = [(g, v) for g, vs in options.items() for v in vs]
    return all(option_matches({g2: w}, {g: v}) == 0 for g, v in values for g2, w in values if (g, v) != (g2, w))


def make_product(rng: random.Random, kind: dict, brand: str, asin: str, category: str) -> dict:
    groups = rng.sample(kind["attrs"], rng.randint(min(4, len(kind["attrs"])), min(5, len(kind["attrs"]))))
    attrs = [split_attr(rng.choice(alts))[0] for alts in groups]
    options = pick_options(rng, kind["options"])
    while not options_distinct(options):  # never with the seed lists above; kept as a guard
        options = pick_options(rng, kind["options"])
    shown = rng.sample(attrs, 2)
    title = f"{brand} {kind['title']} {title_case(shown[0])}, {title_case(shown[1])}"
    if rng.random() < 0.5:
        title += f", {title_case(rng.choice([a for a in attrs if a not in shown]))}"
    bullets = [f"{a.upper()}: {rng.choice(BENEFITS)}" for a in attrs] + [kind["blurb"]]
    description = (f"The {brand} {kind['name']} is {', '.join(attrs[:-1])} and {attrs[-1]}. {kind['blurb']} "
                   f"Backed by {brand}'s satisfaction promise.")
    reviews = [{"title": rng.choice(REVIEW_TITLES), "score": rng.randint(3, 5), "body": rng.choice(REVIEW_BODIES)}
               for _ in range(rng.randint(0, 3))]
    rating = round(sum(r["score"] for r in reviews) / len(reviews), 1) if reviews else "N.A."
    lo, hi = kind["price"]
    return {"asin": asin, "category": category, "Title": title, "name": kind["name"], "type_nouns": kind["nouns"],
            "product_category": kind["path"], "query": kind["query"], "Attributes": attrs, "BulletPoints": bullets,
            "Description": description, "price": round(rng.randint(lo, hi) - 0.01, 2), "options": options,
            "Rating": rating, "Reviews": reviews}


def price_upper(rng: random.Random, price: float) -> float:
    step = 5 if price < 20 else 10
    return float(step * math.ceil(price * rng.uniform(1.05, 1.5) / step))


def instruction(rng: random.Random, kind: dict, attrs: list[str], goal_options: dict[str, str], upper: float) -> str:
    prefix = {split_attr(s)[0]: split_attr(s)[1] for alts in kind["attrs"] for s in alts}
    before = [a for a in attrs if not prefix[a]]
    after = [f"{prefix[a]} {a}" for a in attrs if prefix[a]]
    words = ", ".join(before[:-1]) + " and " + before[-1] if len(before) > 1 else "".join(before)
    head = f"{words} {kind['name']}" if words else kind["name"]
    article = ("some " if rng.random() < 0.5 else "") if kind.get("plural") else \
        ("an " if head[0] in "aeiou" else "a ")
    text = f"{rng.choice(LEADS)} {article}{head}"
    if after:
        text += " " + " and ".join(after)
    phrases = [rng.choice(OPTION_PHRASES[g]).format(v) for g, v in goal_options.items()]
    if phrases:
        text += ", " + ", ".join(phrases)
    return f"{text}, and price lower than {upper:.2f} dollars"


def make_goal(rng: random.Random, product: dict, kind: dict, taken: set) -> dict:
    while True:
        n_attrs = rng.choices([1, 2, 3], weights=[3, 5, 2])[0]
        attrs = rng.sample(product["Attributes"], n_attrs)
        goal_options = {g: rng.choice(vs) for g, vs in product["options"].items()}
        if len(goal_options) > 1 and rng.random() < 0.15:
            goal_options.pop(rng.choice(sorted(goal_options)))
        key = (product["asin"], tuple(sorted(attrs)), tuple(sorted(goal_options.items())))
        upper = price_upper(rng, product["price"])
        text = instruction(rng, kind, attrs, goal_options, upper)
        if key not in taken and text not in taken:  # one goal per request, one request per text
            taken.update([key, text])
            break
    return {"id": "", "split": "", "asin": product["asin"], "category": product["category"],
            "instruction_text": text, "attributes": attrs,
            "goal_options": goal_options, "price_upper": upper, "query": product["query"], "name": product["name"],
            "product_category": product["product_category"], "type_nouns": product["type_nouns"]}


def build() -> tuple[list[dict], list[dict]]:
    rng = random.Random(SEED)
    products, kinds, used_asins = [], {}, set()
    for category, spec in CATEGORIES.items():
        for kind in spec["kinds"]:
            for i in range(PER_KIND):
                asin = f"B0{rng.randint(0, 10 ** 8 - 1):08d}"
                while asin in used_asins:
                    asin = f"B0{rng.randint(0, 10 ** 8 - 1):08d}"
                used_asins.add(asin)
                brand = spec["brands"][(i + rng.randint(0, 7)) % len(spec["brands"])]
                products.append(make_product(rng, kind, brand, asin, category))
                kinds[asin] = kind
    unseen = set()
    for category in CATEGORIES:
        pool = [p["asin"] for p in products if p["category"] == category]
        unseen.update(rng.sample(pool, UNSEEN_PER_CATEGORY))
    train_pool = [p for p in products if p["asin"] not in unseen]
    unseen_pool = [p for p in products if p["asin"] in unseen]
    taken: set = set()
    # every unseen product gets a goal first, the rest of N_UNSEEN go to random unseen products
    unseen_targets = unseen_pool + [rng.choice(unseen_pool) for _ in range(N_UNSEEN - len(unseen_pool))]
    goals = {"train": [p for p in train_pool for _ in range(TRAIN_GOALS_PER_PRODUCT)],
             "seen": rng.sample(train_pool, N_SEEN), "unseen": unseen_targets}
    goals = {split: [make_goal(rng, p, kinds[p["asin"]], taken) for p in targets] for split, targets in goals.items()}
    flat = []
    for split in ("train", "seen", "unseen"):
        for g in goals[split]:
            g["id"], g["split"] = f"ws{len(flat):04d}", split
            flat.append(g)
    return products, flat


def dumps(items: list[dict]) -> str:
    """One JSON object per line: small diffs, still valid JSON."""
    return "[\n" + ",\n".join(json.dumps(x, ensure_ascii=False) for x in items) + "\n]\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="folder to write products.json and goals.json")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    products, goals = build()
    (out / "products.json").write_text(dumps(products), encoding="utf-8")
    (out / "goals.json").write_text(dumps(goals), encoding="utf-8")
    counts = {s: sum(g["split"] == s for g in goals) for s in ("train", "seen", "unseen")}
    print(f"{len(products)} products, goals {counts} -> {out}")


if __name__ == "__main__":
    main()
